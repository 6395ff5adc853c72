"""The options of the serving commands, a module per command (importing them loads no torch, no grpc): `dstool
export` (export_config), the cache gateway (gateway_config), `dstool serve` (serve_config), `dstool infer` and
`dstool batch` (client_config), `dstool keys` (keys_config)."""
