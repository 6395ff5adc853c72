"""KServe v2 on the gateway, as Triton 2.51 speaks it: the HTTP JSON and binary-tensor codec, and the gRPC
endpoint (inference.GRPCInferenceService)."""
