"""The real backend: a torch transformer on a paged KV cache, its runner, profiler and wires.

torch, flashinfer and the wires' libraries are imported only inside this package, so the core
and the simulator run without them.
"""
