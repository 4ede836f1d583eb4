"""What a unit of runtime work yields to the scheduler that drives it.

Every operation that touches the KV (a prefill, an edit, a generation) is written as a generator. After a
bounded piece of work it yields :data:`PAUSE` (others may run now: a long prefill gives way between
chunks); a generation that wants its next token decoded together with other sessions' yields a
:class:`DecodeStep` and receives that token's logits ``[n_vocab]`` back. :func:`drive` runs such a
generator alone, to completion (what the scheduler does for nested calls, and what tests use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, TypeVar


from kvagent.backends.base import Backend


@dataclass(frozen=True)
class DecodeStep:
    """Decode ``token`` at ``position`` of sequence ``seq`` in the next shared batch; send back its logits."""

    token: int
    position: int
    seq: int


PAUSE = None  # yielded after a bounded piece of work
Step = DecodeStep | None
T = TypeVar("T")
Work = Generator[Step, Any, T]


def drive(work: Work[T], backend: Backend | None = None) -> T:
    """Run ``work`` to completion on its own, decoding each :class:`DecodeStep` alone on ``backend`` (work that
    decodes nothing, such as an edit strategy on a test double, needs none)."""
    value: Any = None
    try:
        while True:
            step = work.send(value)
            value = None
            if step is not None:
                if backend is None:
                    work.close()
                    raise TypeError("drive(): the work asked for a decode step and no backend was given")
                value = backend.decode([step.token], [step.position], [step.seq], [True])[0]
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def no_steps(result: T) -> Work[T]:
    """A unit of work that yields nothing and returns ``result`` (for composing with ``yield from``)."""
    return result
    yield  # pragma: no cover - makes this a generator


__all__ = ["PAUSE", "DecodeStep", "Step", "Work", "drive", "no_steps"]
