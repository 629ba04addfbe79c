"""Lookahead decoding as a transformers ``custom_generate`` recipe.

    model.generate(**inputs, custom_generate="PATH/TO/lookahead", trust_remote_code=True,
                   max_new_tokens=128)

PATH/TO/lookahead is the folder that holds this ``custom_generate/`` folder (this repository).
This route hands the function every ``generate`` argument, ``streamer`` and ``stop_strings`` (with
``tokenizer``) included, so nothing is lost on the way; it runs the installed ``lookahead``
package, distribution ``lookahead-decoding`` (requirements.txt): install it from this repository,
``./scripts/setup.sh`` or ``pip install -e PATH/TO/lookahead`` (not ``pip install lookahead``, an
unrelated package on PyPI). Extra keyword arguments
``window_size``, ``ngram_size`` and ``max_candidates`` fix W/N/G; without them the settings are
chosen per step for the model's device, as ``Lookahead()`` does. The output is the one
``model.generate`` gives without it (greedy: token for token).
"""


def generate(model, window_size=None, ngram_size=None, max_candidates=None, **kwargs):
    from lookahead import Lookahead

    # transformers hands over every generate() argument, the unset ones as None: pass on the rest
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    inputs = kwargs.pop("inputs", None)
    return Lookahead(window_size, ngram_size, max_candidates).generate(model, inputs, **kwargs)
