"""The balanced-assignment auction's array operations, on numpy arrays (CPU) or torch tensors (any device).

The auction (assignment.py) is written once against these operations: `_NumpyOps` runs it on the
CPU, where numpy dispatches the small array operations of a round faster than torch, and
`_TorchOps` on accelerators, with no host read but the completion checks. After step 0 everything
is integer arithmetic, so both give bitwise the same assignment. Shapes: the core's legend
(smlp/__init__.py); `table`, `out` and `index` operands may have any length.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["sanitize_scores"]


def _rescale_needed(mag) -> bool:
    # rescale so the row shift cannot overflow (1e38 - -1e38), nor a tiny range underflow
    return mag > 1e30 or 0 < mag < 1e-30


def sanitize_scores(x: Tensor) -> Tensor:
    """NaN and -inf -> lowest finite score (the expert is least wanted), +inf -> highest; no finite
    entry -> all zeros (every assignment is equally good). On the device: no host read."""
    finite = torch.isfinite(x)
    lo = torch.where(finite, x, torch.inf).amin()
    hi = torch.where(finite, x, -torch.inf).amax()
    any_finite = finite.any()
    lo = torch.where(any_finite, lo, 0.0)
    hi = torch.where(any_finite, hi, 0.0)
    return torch.where(finite, x, torch.where(torch.isposinf(x), hi, lo))


@functools.lru_cache(maxsize=256)
def _device_constant(value: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-d tensor filled on the device, with no host-to-device copy that would wait for the stream;
    made once per value, dtype and device and reused by every round, so never modified in place."""
    return torch.full((), value, dtype=dtype, device=device)


class _TorchOps:
    """The operations of steps 0-4 on torch tensors, on any device (see _NumpyOps for the CPU).
    Constants are 0-d tensors of the operand's dtype, filled on the device once (`_device_constant`):
    a Python scalar operand would be converted to a tensor on every call."""

    minimum, where, searchsorted = map(staticmethod, (torch.minimum, torch.where, torch.searchsorted))
    int32, int64, float64 = torch.int32, torch.int64, torch.float64

    def __init__(self, device: torch.device):
        self.device = device

    def empty(self, shape: tuple[int, ...], dtype):
        return torch.empty(shape, dtype=dtype, device=self.device)

    @staticmethod
    def amax(x: Tensor, axis: int | None, keepdims: bool = False) -> Tensor:
        return x.amax() if axis is None else x.amax(dim=axis, keepdim=keepdims)

    @staticmethod
    def transposed_copy(x: Tensor) -> Tensor:
        return x.t().contiguous()

    # Steps 0 and E = 2 read nothing on the host here: values the numpy path branches on stay
    # 0-d tensors, and both branches are computed and selected with torch.where.

    @staticmethod
    def finite_rescaled(x_ES: Tensor) -> tuple[Tensor, Tensor]:
        """(scores, the scale they were divided by): see _NumpyOps.finite_rescaled."""
        x_ES = sanitize_scores(x_ES)  # the identity on finite entries
        mag = x_ES.abs().amax().double()  # compared in float64, as the numpy path compares a float
        unit = torch.where((mag > 1e30) | ((mag > 0) & (mag < 1e-30)), mag, torch.ones_like(mag))
        return x_ES / unit.to(x_ES.dtype), unit

    @staticmethod
    def price_in_units(price_E: Tensor, offset_E1: Tensor, steps, unit) -> Tensor:
        """Expert prices in score units: the column offset plus the auction's price in value steps."""
        return (offset_E1.reshape(-1).double() + price_E.double() / steps) * unit

    @staticmethod
    def where_all_finite(x: Tensor, fallback) -> Tensor:
        return torch.where(torch.isfinite(x).all(), x, fallback())

    @staticmethod
    def first_positive(value: Tensor, fallback) -> Tensor:
        """value if > 0, else fallback() if > 0, else 1 (float64 0-d tensors)."""
        other = fallback()
        return torch.where(value > 0, value, torch.where(other > 0, other, torch.ones_like(other)))

    @staticmethod
    def at_most(value: Tensor, bound: float) -> Tensor:
        return value.clamp(max=bound)

    @staticmethod
    def kth_largest(x_S: Tensor, k: int) -> Tensor:
        return torch.kthvalue(x_S, x_S.shape[0] - k + 1).values

    @staticmethod
    def cumsum(x_S: Tensor) -> Tensor:
        return x_S.cumsum(0)

    @staticmethod
    def count(x_S: Tensor) -> Tensor:
        return x_S.sum()

    @staticmethod
    def difference64(a_S: Tensor, b_S: Tensor) -> Tensor:
        return a_S.double() - b_S.double()

    @staticmethod
    def mean(x: Tensor, axis: int, keepdims: bool = False, dtype=None) -> Tensor:
        return x.mean(dim=axis, keepdim=keepdims, dtype=dtype)

    @staticmethod
    def sum(x: Tensor, axis: int, dtype=None) -> Tensor:
        return x.sum(dim=axis, dtype=dtype)

    @staticmethod
    def upper_median(x_S: Tensor) -> Tensor:
        return -(-x_S).median()  # torch.median is the lower median

    @staticmethod
    def cast(x: Tensor, like: Tensor) -> Tensor:
        return x.to(like.dtype)

    @staticmethod
    def float_max(x: Tensor) -> float:
        return torch.finfo(x.dtype).max

    @staticmethod
    def floor_(x: Tensor) -> Tensor:
        return x.floor_()

    def array(self, t: Tensor) -> Tensor:
        return t

    def tensor(self, a: Tensor) -> Tensor:
        return a

    def arange(self, n: int, dtype):
        return torch.arange(n, dtype=dtype, device=self.device)

    def full(self, n: int, value: int, dtype):
        return torch.full((n,), value, dtype=dtype, device=self.device)

    def const(self, value: int, dtype):
        return _device_constant(value, dtype, self.device)

    @staticmethod
    def clip(x: Tensor, lo, hi) -> Tensor:
        return x.clamp_(lo, hi)

    @staticmethod
    def take(table: Tensor, index_S: Tensor) -> Tensor:
        return table.index_select(0, index_S)

    @staticmethod
    def take_clipped(table: Tensor, index_Z: Tensor) -> Tensor:
        return table.index_select(0, index_Z.clamp(0, table.shape[0] - 1))

    @staticmethod
    def take_columns(x_ZS: Tensor, index_s: Tensor) -> Tensor:
        return x_ZS.index_select(1, index_s)

    @staticmethod
    def bincount(x_S: Tensor, n: int) -> Tensor:
        return torch.bincount(x_S, minlength=n)

    @staticmethod
    def amax0(x_ZS: Tensor) -> Tensor:
        return x_ZS.amax(dim=0)

    @staticmethod
    def sort(x_S: Tensor) -> Tensor:
        return torch.sort(x_S).values

    @staticmethod
    def as_int32(x: Tensor) -> Tensor:
        return x.int()

    @staticmethod
    def as_int64(x: Tensor) -> Tensor:
        return x.long()

    @staticmethod
    def put(out: Tensor, index_S: Tensor, value_S) -> None:
        """out[index] = value (a tensor of index's shape, or a Python number: index_fill_ with a
        0-d tensor value reads it on the host)."""
        if isinstance(value_S, Tensor):
            out.scatter_(0, index_S, value_S)
        else:
            out.index_fill_(0, index_S, value_S)

    @staticmethod
    def sub_out(a: Tensor, b: Tensor, out: Tensor) -> None:
        torch.sub(a, b, out=out)


class _NumpyOps:
    """The same operations on numpy arrays, for the CPU: at router sizes dispatching a round's ~30
    operations is most of its cost, and numpy dispatches them, and sorts int64, faster than torch.
    Python scalars keep the array's dtype (numpy >= 2 promotion rules)."""

    minimum, where, searchsorted = map(staticmethod, (np.minimum, np.where, np.searchsorted))
    int32, int64, float64 = np.int32, np.int64, np.float64
    device = torch.device("cpu")

    @staticmethod
    def empty(shape: tuple[int, ...], dtype):
        return np.empty(shape, dtype=dtype)

    @staticmethod
    def amax(x: np.ndarray, axis: int | None, keepdims: bool = False) -> np.ndarray:
        return np.maximum.reduce(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def mean(x: np.ndarray, axis: int, keepdims: bool = False, dtype=None) -> np.ndarray:
        # what ndarray.mean computes, without its Python-level argument handling
        return np.add.reduce(x, axis=axis, keepdims=keepdims, dtype=dtype) / x.shape[axis]

    @staticmethod
    def transposed_copy(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x.T)

    @staticmethod
    def finite_rescaled(x_ES: np.ndarray) -> tuple[np.ndarray, float]:
        """(scores with every entry finite, the scale they were divided by: 1 unless their magnitude
        was extreme)."""
        mag = float(np.maximum.reduce(abs(x_ES), axis=None))  # NaN propagates
        if not math.isfinite(mag):
            x_ES = sanitize_scores(torch.from_numpy(x_ES)).numpy()
            mag = float(np.maximum.reduce(abs(x_ES), axis=None))
        return (x_ES / mag, mag) if _rescale_needed(mag) else (x_ES, 1.0)

    @staticmethod
    def price_in_units(price_E: np.ndarray, offset_E1: np.ndarray, steps: float, unit: float) -> np.ndarray:
        """Expert prices in score units: the column offset plus the auction's price in value steps."""
        return (offset_E1.reshape(-1).astype(np.float64) + price_E / steps) * unit

    @staticmethod
    def where_all_finite(x: np.ndarray, fallback) -> np.ndarray:
        return x if np.isfinite(x).all() else fallback()

    @staticmethod
    def first_positive(value, fallback) -> float:
        value = float(value)
        if value > 0:
            return value
        value = float(fallback())
        return value if value > 0 else 1.0

    @staticmethod
    def at_most(value: float, bound: float) -> float:
        return min(value, bound)

    @staticmethod
    def kth_largest(x_S: np.ndarray, k: int):
        return np.partition(x_S, x_S.shape[0] - k)[x_S.shape[0] - k]

    @staticmethod
    def cumsum(x_S: np.ndarray) -> np.ndarray:
        return np.cumsum(x_S)

    @staticmethod
    def count(x_S: np.ndarray) -> int:
        return int(np.count_nonzero(x_S))

    @staticmethod
    def difference64(a_S: np.ndarray, b_S: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite results are handled
            return np.subtract(a_S, b_S, dtype=np.float64)

    @staticmethod
    def sum(x: np.ndarray, axis: int, dtype=None) -> np.ndarray:
        return np.add.reduce(x, axis=axis, dtype=dtype)

    @staticmethod
    def upper_median(x_S: np.ndarray):
        k = x_S.shape[0] // 2
        return np.partition(x_S, k)[k]

    @staticmethod
    def cast(x: np.ndarray, like: np.ndarray) -> np.ndarray:
        return x.astype(like.dtype)

    @staticmethod
    def float_max(x: np.ndarray) -> float:
        return float(np.finfo(x.dtype).max)

    @staticmethod
    def floor_(x: np.ndarray) -> np.ndarray:
        return np.floor(x, out=x)

    @staticmethod
    def array(t: Tensor) -> np.ndarray:
        return t.numpy()

    @staticmethod
    def tensor(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    @staticmethod
    def arange(n: int, dtype):
        return np.arange(n, dtype=dtype)

    @staticmethod
    def full(n: int, value: int, dtype):
        return np.full(n, value, dtype=dtype)

    @staticmethod
    def const(value: int, dtype):
        return value

    @staticmethod
    def clip(x: np.ndarray, lo, hi) -> np.ndarray:
        # np.clip costs several times np.maximum on small arrays
        if lo is not None:
            np.maximum(x, lo, out=x)
        return x if hi is None else np.minimum(x, hi, out=x)

    @staticmethod
    def take(table: np.ndarray, index_S: np.ndarray) -> np.ndarray:
        return table.take(index_S)

    @staticmethod
    def take_clipped(table: np.ndarray, index_Z: np.ndarray) -> np.ndarray:
        return table.take(index_Z, mode="clip")

    @staticmethod
    def take_columns(x_ZS: np.ndarray, index_s: np.ndarray) -> np.ndarray:
        return x_ZS.take(index_s, axis=1)

    @staticmethod
    def bincount(x_S: np.ndarray, n: int) -> np.ndarray:
        return np.bincount(x_S, minlength=n)

    @staticmethod
    def amax0(x_ZS: np.ndarray) -> np.ndarray:
        return x_ZS.max(axis=0)

    @staticmethod
    def sort(x_S: np.ndarray) -> np.ndarray:
        x_S.sort()  # in place: the callers pass a temporary
        return x_S

    @staticmethod
    def as_int32(x: np.ndarray) -> np.ndarray:
        return x.astype(np.int32)

    @staticmethod
    def as_int64(x: np.ndarray) -> np.ndarray:
        return x.astype(np.int64)

    @staticmethod
    def put(out: np.ndarray, index_S: np.ndarray, value_S) -> None:
        out[index_S] = value_S

    @staticmethod
    def sub_out(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        np.subtract(a, b, out=out)
