"""A paired image-text dataset on every machine: scikit-learn's 1,797 handwritten 8x8 digits
(UCI's optical digits, bundled with scikit-learn), each with a caption generated from what the
image shows: its digit, how heavy its strokes are and which way it leans.

Stroke weight is the ink (summed intensity) and lean the shear of the ink's second moments
(x against y), each cut into thirds within the image's own digit, so every digit has thin,
medium and bold, left-leaning, upright and right-leaning examples: 90 descriptions, phrased by
one of three templates chosen per image. A pair's *group* is its description (digit, weight,
lean): retrieval counts any item of the query's group as a match (``retrieval``).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
WEIGHT = ("thin", "medium", "bold")
LEAN = ("leaning left", "upright", "leaning right")
TEMPLATES = (
    "a {weight} handwritten {word} , {lean}",
    "the digit {digit} in {weight} strokes , {lean}",
    "{word} written {weight} and {lean}",
)
PAD, CLS, SEP, UNK = "[PAD]", "[CLS]", "[SEP]", "[UNK]"


@dataclasses.dataclass(frozen=True)
class Pairs:
    images: np.ndarray
    "float32 [N, 8, 8] in [0, 1]."
    captions: tuple[str, ...]
    groups: np.ndarray
    "int [N]: digit * 9 + weight * 3 + lean."
    name: str

    @property
    def digest(self) -> str:
        h = hashlib.sha256(self.images.tobytes())
        h.update("\n".join(self.captions).encode())
        return h.hexdigest()


def vocabulary() -> list[str]:
    """Every word a caption can hold, special tokens first (the text encoder's vocabulary)."""
    words = {w for t in TEMPLATES for w in t.replace("{", " ").replace("}", " ").split()}
    words |= set(WORDS) | set(WEIGHT) | {w for lean in LEAN for w in lean.split()}
    words |= {str(d) for d in range(10)}
    words -= {"word", "weight", "lean", "digit"}
    return [PAD, CLS, SEP, UNK, *sorted(words)]


def _thirds(values: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """0, 1, 2: the lower, middle and upper third of ``values`` within each label."""
    out = np.zeros(len(values), np.int64)
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        ranks = np.argsort(np.argsort(values[rows], kind="stable"), kind="stable")
        out[rows] = ranks * 3 // len(rows)
    return out


def _lean(images: np.ndarray) -> np.ndarray:
    """Shear of the ink: how much x grows as y goes up the image (positive: leaning right)."""
    y, x = np.mgrid[0:8, 0:8].astype(np.float64)
    y = 7 - y  # rows count downwards
    mass = images.sum((1, 2))
    mx = (images * x).sum((1, 2)) / mass
    my = (images * y).sum((1, 2)) / mass
    cov = (images * (x - mx[:, None, None]) * (y - my[:, None, None])).sum((1, 2)) / mass
    var = (images * (y - my[:, None, None]) ** 2).sum((1, 2)) / mass
    return cov / var


def digits_pairs(seed: int = 0) -> Pairs:
    try:
        from sklearn.datasets import load_digits  # the optional dependency, only for this dataset
    except ImportError:
        raise ValueError(
            'fusemix.dataset=digits needs scikit-learn: pip install -e ".[fusemix]"'
        ) from None

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)
    labels = data.target.astype(np.int64)
    weight = _thirds(images.sum((1, 2)), labels)
    lean = _thirds(_lean(images), labels)
    template = np.random.default_rng(seed).integers(0, len(TEMPLATES), len(labels))
    captions = tuple(
        TEMPLATES[t].format(word=WORDS[d], digit=d, weight=WEIGHT[w], lean=LEAN[s])
        for t, d, w, s in zip(template, labels, weight, lean)
    )
    return Pairs(images, captions, labels * 9 + weight * 3 + lean, "sklearn-digits")


def image_inputs(images: np.ndarray, size: int, mean, std, channels: int = 3) -> np.ndarray:
    """[N, 8, 8] -> pixel_values [N, channels, size, size]: nearest upsampling (size a
    multiple of 8), the grey level in every channel, normalised as the encoder expects."""
    if size % images.shape[-1]:
        raise ValueError(f"image_size={size} is not a multiple of the digits' 8 pixels")
    scale = size // images.shape[-1]
    big = images.repeat(scale, axis=1).repeat(scale, axis=2)[:, None]
    mean = np.asarray(mean, np.float32)[None, :channels, None, None]
    std = np.asarray(std, np.float32)[None, :channels, None, None]
    return ((np.repeat(big, channels, axis=1) - mean) / std).astype(np.float32)


def text_inputs(captions, tokenizer, max_len: int, pad_id: int = 0):
    """``(input_ids, attention_mask)`` int32 [N, max_len] with the tokenizer's own template;
    a caption longer than ``max_len`` tokens is a ValueError."""
    ids = np.full((len(captions), max_len), pad_id, np.int32)
    mask = np.zeros((len(captions), max_len), np.int32)
    for i, caption in enumerate(captions):
        tokens = tokenizer.encode(caption)
        if len(tokens) > max_len:
            raise ValueError(f"caption {caption!r} is {len(tokens)} tokens, longer than {max_len}")
        ids[i, : len(tokens)], mask[i, : len(tokens)] = tokens, 1
    return ids, mask


def split(n: int, val: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train rows, held-out rows)``, both sorted; the held-out ones drawn by ``seed``."""
    order = np.random.default_rng([seed, 7]).permutation(n)
    return np.sort(order[val:]), np.sort(order[:val])
