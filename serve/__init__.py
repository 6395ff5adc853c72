"""dstool.serve: Triton model repositories, a real Triton server, and tritonclient inference."""
