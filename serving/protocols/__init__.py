"""Protocol adapters over the core: TF Serving REST (`rest`), KServe V2 (`kserve`), TF Serving gRPC (`grpc_api`),
and the Flask app that mounts the HTTP ones (`app`). Each turns its wire format into a `serving.core.DataPlane` call."""
