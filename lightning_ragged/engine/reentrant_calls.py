"""Whether a module call runs inside a reentrant activation checkpoint's forward.

``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)`` (also transformers' and the
checkpoint wrapper's reentrant mode) runs ``fn`` under ``no_grad`` in the forward, then again inside
backward, where its gradient arrives in a nested backward. A group called that way and also
plainly must not reduce after the plain call's backward: the recomputation's gradient would come
after the reduction and be lost. Other ``no_grad`` calls in a training forward (a frozen teacher,
a reference policy) get no gradient later, so their groups keep reducing as they go: only this
forward is recognized, by its code object on the Python stack (looked for only in that ``no_grad``
branch, a few dozen frames at most). Its recomputation is recognized the same way (the checkpoint's
backward on the stack): a group called only so reduces and frees at the end of each nested backward,
as after a plain call, instead of holding its full and gradient buffers to the end of the backward.
"""

from __future__ import annotations

import sys

from torch.utils.checkpoint import CheckpointFunction

_CHECKPOINT_FORWARD = CheckpointFunction.forward.__code__
_CHECKPOINT_BACKWARD = CheckpointFunction.backward.__code__
_MAX_DEPTH = 64


def in_reentrant_checkpoint() -> bool:
    """True when ``torch.utils.checkpoint``'s reentrant forward is on the caller's stack."""
    return _on_stack(_CHECKPOINT_FORWARD)


def in_reentrant_recomputation() -> bool:
    """True when a reentrant checkpoint's backward, re-running the forward, is on the caller's stack."""
    return _on_stack(_CHECKPOINT_BACKWARD)


def _on_stack(code: object) -> bool:
    frame = sys._getframe(2)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
