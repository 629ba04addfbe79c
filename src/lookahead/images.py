"""Images that a chat request carries as OpenAI's ``image_url`` content parts, decoded safely.

The server fetches nothing: an image comes inside the request as a data URL,
``data:image/<type>;base64,<data>``. It is decoded with Pillow from the formats OpenAI takes (PNG,
JPEG, WebP, GIF: Pillow's other readers, some of which run external programs, are never tried),
and its size is read from its header and checked against a pixel limit before any pixel is
decoded, so that a small file declaring a huge image (a decompression bomb) allocates nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import re

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what OpenAI accepts
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # about 50 MB once decoded as RGB
DEFAULT_MAX_IMAGES = 8  # per request
_DATA_URL = re.compile(r"data:image/[\w.+-]+((?:;[^;,]*)*);base64,", re.IGNORECASE)
_WHITESPACE = re.compile(rb"\s+")
DATA_URL_EXAMPLE = "data:image/png;base64,..."


class ImageError(ValueError):
    """An image a request carries that the server does not take; the message says why."""


def decode_data_url(url: str, max_pixels: int):
    """The RGB ``PIL.Image`` a data URL holds; :class:`ImageError` for another URL, data that is
    not base64 or not an image of ``FORMATS``, or an image of more than ``max_pixels`` pixels."""
    match = _DATA_URL.match(url)
    if match is None:
        if re.match(r"[a-z][a-z0-9+.-]*:", url, re.IGNORECASE) and not url.lower().startswith("data:"):
            raise ImageError(
                f"this server does not fetch images: send the image itself as a data URL ({DATA_URL_EXAMPLE})"
            )
        raise ImageError(f"an image URL must be a base64 data URL of an image, data:image/<type>;base64,<data> "
                         f"({DATA_URL_EXAMPLE})")  # fmt: skip
    try:
        data = base64.b64decode(_WHITESPACE.sub(b"", url[match.end() :].encode("ascii")), validate=True)
    except (binascii.Error, UnicodeEncodeError) as err:
        raise ImageError(f"the image's data is not valid base64: {err}") from err
    if not data:
        raise ImageError("the image's data is empty")
    return _decode(data, max_pixels)


def _decode(data: bytes, max_pixels: int):
    from PIL import Image, UnidentifiedImageError

    try:
        picture = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError as err:  # its header declares twice Pillow's own limit
        raise ImageError(f"the image is too large: over this server's limit of {max_pixels} pixels") from err
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise ImageError(f"the data is not an image this server reads ({', '.join(FORMATS)})") from err
    width, height = picture.size
    if width * height > max_pixels:
        raise ImageError(f"the image is {width}x{height}, {width * height} pixels, past this server's limit of "
                         f"{max_pixels} pixels: send a smaller one")  # fmt: skip
    if width * height == 0:
        raise ImageError("the image has no pixels")
    try:
        picture.load()
        return _rgb(picture)
    except Exception as err:  # noqa: BLE001 - a truncated or corrupt file: any reader's error
        raise ImageError(f"the image could not be decoded: {err}") from err


def _rgb(picture):
    """``picture`` in RGB, transparency laid on white (as transformers' ``convert_to_rgb``)."""
    from PIL import Image

    if picture.mode == "RGB":
        return picture
    if "A" in picture.getbands() or picture.info.get("transparency") is not None:
        rgba = picture.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return picture.convert("RGB")
