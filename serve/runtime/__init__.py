"""dstool.serve.runtime: running what export wrote. triton (a Triton server process from the nvidia-pytriton wheel:
start, wait until ready, stop), server (`dstool serve`: Triton, and the cache gateway in front with --cache), k8s
(`dstool serve --emit k8s`: the same tier as Kubernetes objects), client (`dstool infer` over Triton's clients).
"""
