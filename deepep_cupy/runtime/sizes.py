"""Integer size arithmetic shared by every layout (one definition of rounding up)."""


def align(x: int, a: int) -> int:
    """`x` rounded up to a multiple of `a` (`a` > 0)."""
    return (x + a - 1) // a * a


def ceil_div(x: int, a: int) -> int:
    """`x / a` rounded up (`a` > 0)."""
    return (x + a - 1) // a
