"""One codec per wire format: bytes or messages in, typed requests and numpy arrays out, and answers back to bytes.

`strict_json` (JSON as a server facing the internet must read it), `text` (numbers and base64 as the formats spell
them), `tfserving_json` (TF Serving's REST bodies), `v2_tensors` (KServe V2's datatypes and BYTES framing),
`v2_json` (V2 over REST, with Triton's binary extension), `v2_grpc` (V2's gRPC tensors) and `tensor_proto` (TF
Serving's TensorProtos). No codec imports Flask or grpc (the import-linter contract in pyproject.toml checks it):
the REST and gRPC adapters move bytes to a codec and its result to the DataPlane, and the batch job reads the same
JSON through the same codec. Every malformed input is one ServingError(INVALID_ARGUMENT) naming what was wrong.
"""
