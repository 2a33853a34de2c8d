"""The image files the converters embed: their format and size from the header, the bytes to store
(re-encoded when Model Garden's decoder would not read them as one RGB image), and an image named by
an annotation found only inside its images folder."""

from __future__ import annotations

import os

from od_dist.data.errors import BadAnnotation


def image_format(path: str) -> tuple[str, tuple[int, int]]:
    """('jpeg'|'png'|..., (width, height)) from the file's header; BadAnnotation when not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return (im.format or "").lower(), im.size
    except Image.DecompressionBombError:  # a header claiming more pixels than any photo has
        raise BadAnnotation(
            f"image '{path}': claims more than {2 * Image.MAX_IMAGE_PIXELS} pixels, not a photo to "
            "train on; replace the file or remove its annotation"
        ) from None
    except (UnidentifiedImageError, OSError) as e:
        raise BadAnnotation(
            f"image '{path}': not a readable image ({e.__class__.__name__}); replace "
            "the file or remove its annotation"
        ) from None


# Formats written as they are: what Model Garden's decoder (tf.io.decode_image, 3 channels) reads as
# one RGB image. Any other is re-encoded as PNG: a GIF would come back as a stack of frames, a BMP
# may be a kind TensorFlow's reader refuses, TIFF and WebP it does not read at all.
DECODABLE = ("jpeg", "png")
# Image files the converters and `predict` pick up: PIL opens each (the others re-encoded as above).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def encoded_image(path: str, fmt: str) -> tuple[bytes, str]:
    """The bytes to store for the image at `path` (PIL's format `fmt`) and their image/format."""
    if fmt in DECODABLE:
        with open(path, "rb") as f:
            return f.read(), "jpg" if fmt == "jpeg" else fmt
    import io

    from PIL import Image

    buf = io.BytesIO()
    with Image.open(path) as im:
        im.convert("RGB").save(buf, format="PNG")
    return buf.getvalue(), "png"


def image_under(images_dir: str, name: str) -> tuple[str | None, bool]:
    """(`images_dir`/`name` if that is a file, whether it stays inside `images_dir` once `..`, an
    absolute name and every symlink are resolved). The records embed the file's bytes: a name
    from an annotation must not pull in a file from elsewhere."""
    path = os.path.join(images_dir, name)
    if not os.path.isfile(path):
        return None, True
    base = os.path.realpath(images_dir)
    return path, os.path.commonpath([os.path.realpath(path), base]) == base
