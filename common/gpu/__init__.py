"""What any chapter's GPU code stands on, whichever chapter it serves: cuda_driver, the few
CUDA driver calls made through cffi; kernel_call, kernel launches at the driver's cost.
"""
