"""One description of a generated input space, drawn two ways: by hypothesis (shrinking,
edge cases) for the properties, and by a seeded `random.Random` for counting how many of
its inputs the model plans. Both draw from the same ranges, so a count over the sample
says something about the space the properties explore."""
from __future__ import annotations

import random
from typing import Callable, Protocol, Sequence, TypeVar

from hypothesis import strategies as st

T = TypeVar("T")


class Pick(Protocol):
    def integer(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        ...

    def choice(self, options: Sequence[T]) -> T:
        """One of `options`."""
        ...


class _Drawn:
    def __init__(self, draw: Callable) -> None:
        self._draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self._draw(st.integers(lo, hi))

    def choice(self, options: Sequence[T]) -> T:
        return self._draw(st.sampled_from(options))


class _Seeded:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self._rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return self._rng.choice(options)


def strategy(build: Callable[[Pick], T]) -> st.SearchStrategy[T]:
    """The hypothesis strategy of `build`."""
    return st.composite(lambda draw: build(_Drawn(draw)))()


def sample(build: Callable[[Pick], T], count: int = 200, seed: int = 2024) -> list[T]:
    """`count` inputs of `build`, the same ones every run."""
    pick = _Seeded(random.Random(seed))
    return [build(pick) for _ in range(count)]


def either(pick: Pick, constants: Sequence[int], lo: int, hi: int) -> int:
    """One of `constants` or an integer in [lo, hi], each as likely (hypothesis's
    `one_of(just(c)..., integers(lo, hi))`)."""
    index = pick.integer(0, len(constants))
    return constants[index] if index < len(constants) else pick.integer(lo, hi)


def assert_fails(prop: Callable[[], None], *errors: type[Exception]) -> None:
    """That a hypothesis property fails, each failure one of `errors` (hypothesis
    reports several distinct failures as an ExceptionGroup)."""
    try:
        prop()
    except ExceptionGroup as group:
        rest = group.split(errors)[1]
        assert rest is None, f"{prop.__name__} failed otherwise: {rest!r}"
    except errors:
        pass
    else:
        raise AssertionError(f"{prop.__name__} passed")
