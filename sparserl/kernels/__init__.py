"""Hand-written GPU kernels (Triton) with their pure-torch references.

Each kernel module keeps triton optional: it imports without triton, and says through `kernel_available(device)`
whether its kernel can run on a device (CUDA, or CPU under `TRITON_INTERPRET=1`, the interpreter the tests use).
Nothing here imports the rest of sparserl; the engines choose when to call in.
"""
