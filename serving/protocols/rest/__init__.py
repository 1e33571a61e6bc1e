"""The REST port: one Flask app (`app`) with TF Serving's /v1 API (`tfserving`), KServe V2 (`kserve`), the OpenAPI
contract (`openapi`) and the web UI (`web`); `httputil` (bodies, errors) and `admission` (each request's hold on
the memory budget) serve them all."""
