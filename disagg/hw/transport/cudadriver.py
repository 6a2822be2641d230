"""The few CUDA driver calls the cuda wire needs for copies between two GPUs.

torch maps another process's memory (CUDA IPC) in a context of the GPU that holds it. A copy
issued from another GPU into such a mapping is not a peer copy: the driver stages it through the
host, far slower than a peer copy over NVLink (docs/gpu-runs.md). So for a peer on another GPU
the wire maps the region itself, in the *sender's* context with peer access enabled, and copies
with cuMemcpyDtoDAsync on its own stream. Everything here goes through libcuda.so.1 (the driver,
present wherever a GPU is); no extra package.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from disagg.errors import TransportError

LAZY_ENABLE_PEER_ACCESS = 0x1
MEMORYTYPE_DEVICE = 2
ATTRIBUTE_MAX_PITCH = 11
CUdeviceptr = ctypes.c_uint64


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (device to device: the host and array fields stay zero)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", CUdeviceptr),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", CUdeviceptr),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # not c_char: its bytes stop at a NUL


@functools.cache
def _lib() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise TransportError(f"cuda wire: cannot load the CUDA driver (libcuda.so.1): {e}") from e
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(CUdeviceptr), IpcHandle, ctypes.c_uint]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), CUdeviceptr]
    lib.cuIpcCloseMemHandle.argtypes = [CUdeviceptr]
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(CUdeviceptr),
        ctypes.POINTER(ctypes.c_size_t),
        CUdeviceptr,
    ]
    lib.cuMemcpyDtoDAsync_v2.argtypes = [CUdeviceptr, CUdeviceptr, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(Memcpy2D), ctypes.c_void_p]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(result, ctypes.byref(name))
        raise TransportError(f"cuda wire: {what} failed: {(name.value or b'?').decode()}")


def export(ptr: int) -> tuple[bytes, int]:
    """(IPC handle of the allocation holding device address `ptr`, ptr's offset in it).
    Call with the allocation's GPU current."""
    base, size = CUdeviceptr(), ctypes.c_size_t()
    _check(_lib().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "range")
    handle = IpcHandle()
    _check(_lib().cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return bytes(handle.reserved), ptr - int(base.value or 0)


def open_handle(handle: bytes) -> int:
    """Map an exported allocation into the current GPU's context (peer access enabled)."""
    if len(handle) != 64:
        raise TransportError(f"cuda wire: an IPC handle is 64 bytes, got {len(handle)}")
    h = IpcHandle()
    h.reserved[:] = handle
    ptr = CUdeviceptr()
    _check(
        _lib().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, LAZY_ENABLE_PEER_ACCESS),
        "cuIpcOpenMemHandle",
    )
    return int(ptr.value or 0)


def close_handle(ptr: int) -> None:
    _check(_lib().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Device-to-device copy of `nbytes` on `stream` (a cudaStream_t); both addresses mapped in
    the stream's context."""
    _check(_lib().cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def copy_2d_async(
    dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int
) -> None:
    """`height` rows of `width` bytes, row r from `src + r * src_pitch` to `dst + r * dst_pitch`,
    on `stream`: one copy for the same run of pages in `height` layers whose tensors lie at a
    uniform distance from each other (pitches at most `max_pitch` of the device)."""
    p = Memcpy2D(
        srcMemoryType=MEMORYTYPE_DEVICE,
        srcDevice=src,
        srcPitch=src_pitch,
        dstMemoryType=MEMORYTYPE_DEVICE,
        dstDevice=dst,
        dstPitch=dst_pitch,
        WidthInBytes=width,
        Height=height,
    )
    _check(_lib().cuMemcpy2DAsync_v2(ctypes.byref(p), stream), "cuMemcpy2DAsync")


@functools.cache
def max_pitch(ordinal: int) -> int:
    """The largest pitch a 2D copy on GPU `ordinal` accepts (CU_DEVICE_ATTRIBUTE_MAX_PITCH)."""
    dev, value = ctypes.c_int(), ctypes.c_int()
    _check(_lib().cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    _check(
        _lib().cuDeviceGetAttribute(ctypes.byref(value), ATTRIBUTE_MAX_PITCH, dev),
        "cuDeviceGetAttribute",
    )
    return int(value.value)
