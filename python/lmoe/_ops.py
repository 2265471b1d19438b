"""Loads the ops library, declares the ops' fake (meta) implementations for torch.compile, and
turns the library's errors into lmoe.Error."""
import os

import torch

__version__ = "0.1.0"

torch.ops.load_library(os.path.join(os.path.dirname(__file__), "_lmoe_ops.so"))
ops = torch.ops.lmoe

# The prefix the ops library puts before an lmoe::Error's message (python/csrc/ops.cpp).
_MARKER = "lmoe::Error: "


class Error(RuntimeError):
    """An error of the lmoe library (bad input, ranks that disagree, a tier that cannot run), with
    the library's message. Raised on every rank of the group alike, before anything is launched."""


def translate(error):
    """lmoe.Error for an lmoe::Error that crossed the op boundary as a RuntimeError, else None."""
    text = str(error)
    at = text.find(_MARKER)
    if at < 0:
        return None
    message = text[at + len(_MARKER):]
    # Some torch versions append the C++ frames after the message.
    cut = message.find("\nException raised from")
    return Error((message if cut < 0 else message[:cut]).rstrip())


def call(op, *args):
    """op(*args) with lmoe's errors raised as lmoe.Error (eager calls; a compiled graph raises the
    RuntimeError whose text carries the same message)."""
    try:
        return op(*args)
    except RuntimeError as error:
        translated = translate(error)
        if translated is None:
            raise
        raise translated from None


@torch.library.register_fake("lmoe::tail_forward")
def _tail_forward_fake(tail, routed, shared, norm_weight, up_proj_weight, out, tier="auto"):
    # Mutates shared and out in place and returns nothing: no new tensors to describe.
    return None


@torch.library.register_fake("lmoe::reference_tail")
def _reference_tail_fake(routed, shared, norm_weight, up_proj_weight, eps, latent_norm, contract, out):
    return None


@torch.library.register_fake("lmoe::library_tail")
def _library_tail_fake(routed, shared, norm_weight, up_proj_weight, eps, latent_norm, tier, out):
    return None
