"""DLPack for python models' tensors, on the CPU: `pb_utils.Tensor.to_dlpack()` / `from_dlpack()`.

Owns: turning a tensor's numpy array into a DLPack capsule (zero-copy; a read-only array, as
inputs decoded from the wire are, is copied once, since DLPack's legacy capsule cannot say
"read-only"), and turning a capsule or any object with `__dlpack__` / `__dlpack_device__`
(torch, numpy, ...) into a numpy array that shares its memory. BF16 has no numpy type of its
own: it travels as `ml_dtypes.bfloat16` arrays here (as in `triton_compat.frontend.tensors`) and crosses
DLPack through torch. Errors are Triton's texts (python_backend src/pb_tensor.cc), raised as
`TritonModelException`; GPU memory is refused (tensors of this backend live in host memory).
Reference: python_backend README, "Interoperability and GPU Support".
"""

from __future__ import annotations

import ctypes

import numpy as np

from triton_compat.errors import TritonModelException

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3      # DLDeviceType
KDL_BFLOAT = 4                                    # DLDataTypeCode

NOT_CONTIGUOUS = ("DLPack tensor is not contiguous. Only contiguous DLPack tensors that are "
                  "stored in C-Order are supported.")
STRINGS = "DLPack does not have support for string tensors."
NOT_SUPPORTED = ("Provided tensor is not supported. Tensor must be a DLPack capsule or have "
                 "`__dlpack__` and `__dlpack_device__` attributes")


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):          # the head of DLManagedTensor (dlpack.h)
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                                        ctypes.c_char_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype, _capsule_valid.argtypes = ctypes.c_int, [ctypes.py_object,
                                                                 ctypes.c_char_p]


def _error(message: str) -> Exception:
    return TritonModelException(message)


def is_bf16(array: np.ndarray) -> bool:
    """Whether `array` holds BF16 (`ml_dtypes.bfloat16`, a numpy dtype of kind "V")."""
    return array.dtype.kind == "V" and array.dtype.name == "bfloat16"


def is_capsule(obj) -> bool:
    """Whether `obj` is a PyCapsule (a DLPack capsule, used or not)."""
    return type(obj).__name__ == "PyCapsule"


def to_capsule(array: np.ndarray):
    """A DLPack capsule ("dltensor") over `array`'s memory. Raises TritonModelException for
    BYTES (strings)."""
    if array.dtype.kind in "OSU":
        raise _error(STRINGS)
    if not array.flags.writeable:
        array = array.copy()
    if is_bf16(array):
        import torch
        from torch.utils.dlpack import to_dlpack
        return to_dlpack(torch.from_numpy(array.view(np.int16)).view(torch.bfloat16))
    return array.__dlpack__()


class _Capsule:
    """A bare capsule given the producer interface `np.from_dlpack` expects."""

    def __init__(self, capsule) -> None:
        if not _capsule_valid(capsule, b"dltensor"):
            raise _error("DLPack capsule has already been consumed")
        self.capsule = capsule
        self.head = ctypes.cast(_capsule_pointer(capsule, b"dltensor"),
                                ctypes.POINTER(_DLTensor)).contents

    def __dlpack__(self, stream=None, **_):
        return self.capsule

    def __dlpack_device__(self):
        return self.head.device.device_type, self.head.device.device_id


def _check_device(device: tuple) -> None:
    kind = int(device[0])
    if kind == KDL_CUDA:
        raise _error("DLPack tensor is in GPU memory: this python backend keeps tensors in "
                     "host memory (copy it to the CPU first, e.g. tensor.cpu())")
    if kind not in (KDL_CPU, KDL_CUDA_HOST):
        raise _error(f"DLDevice type {kind} is not support by Python backend.")


def _bf16_array(obj) -> np.ndarray:
    """A BF16 DLPack tensor (torch's bfloat16) as an `ml_dtypes.bfloat16` array."""
    import ml_dtypes
    import torch
    from torch.utils.dlpack import from_dlpack
    t = obj if isinstance(obj, torch.Tensor) else from_dlpack(obj)
    if not t.is_contiguous():
        raise _error(NOT_CONTIGUOUS)
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def from_object(obj) -> np.ndarray:
    """The numpy array sharing the memory of a DLPack capsule or a `__dlpack__` object (its
    C-contiguous layout required). Raises TritonModelException with Triton's texts."""
    if is_capsule(obj):
        obj = _Capsule(obj)
        _check_device(obj.__dlpack_device__())
        if obj.head.dtype.code == KDL_BFLOAT:
            return _bf16_array(obj.capsule)
    elif hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        _check_device(obj.__dlpack_device__())
        if str(getattr(obj, "dtype", "")) == "torch.bfloat16":
            return _bf16_array(obj)
    else:
        raise _error(NOT_SUPPORTED)
    try:
        array = np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError) as e:
        raise _error(f"DLPack tensor cannot be read: {e}") from None
    if not array.flags.c_contiguous:
        raise _error(NOT_CONTIGUOUS)
    return array
