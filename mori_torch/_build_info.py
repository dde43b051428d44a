# Written by setup.py: the torch this extension was compiled against.
TORCH_VERSION = '2.14.1+cu130'
TORCH_CUDA = '13.0'
TORCH_HIP = None
WITH_GPU = True
