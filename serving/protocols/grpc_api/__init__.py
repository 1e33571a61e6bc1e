"""The gRPC port: `server` assembles TF Serving's services (`tfserving`), KServe V2's (`kserve`) and grpc.health.v1
(`health`) as peers behind `gate` (memory budget, tokens, access log), on --port and --grpc_socket_path
(`unix_socket`); `common` holds what the servicers share. (Named grpc_api, not grpc, so that it can never shadow
the grpc package.)"""
