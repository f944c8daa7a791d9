# Without a GPU, Triton kernels run in Triton's interpreter (on CPU tensors), so the kernel code
# itself is tested here too, not only its PyTorch reference. Set before fastgen_kernels imports.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
