"""Protocol adapters over the dataplane, in three packages: `codec` (one per wire format, neither Flask nor grpc),
`rest` (the Flask app: TF Serving's /v1 and KServe V2 over HTTP) and `grpc_api` (the gRPC server: TF Serving's
services, KServe V2's and health, behind one gate). Beside them, what both transports share: `auth`, `access_log`
and `v2` (KServe V2's documents). Each adapter moves bytes to a codec and the codec's result to a
`serving.core.DataPlane` call (docs/ARCHITECTURE.md)."""
