"""What a request's parts cost in memory while it is served: measured figures, one table for every reader.

The codecs and adapters charge request bodies by them as they read, the core charges decoded pixels and examples,
and the default budget (serving/process/memory_budget.py) sizes its floor by them. They import nothing, so the
codecs that charge bodies need none of the code that reads the host's memory (serving/host/memory.py).
"""
# Decoding holds the uint8 RGB image (3 bytes a pixel) and the decoder's working rows; the resize writes only the
# model's small input, and the model's per-batch tensors are smaller than that input. 4 bytes a pixel covers all
# of it, measured with benchmarks/memory.py.
BYTES_PER_PIXEL = 4
# What a request body costs while it is served, for each byte received: the bytes, a second copy while they are
# read or parsed (werkzeug joins the pieces read; JSON is parsed from text; gRPC hands over the serialized message),
# the parsed strings or deserialized message, and the decoded inputs (3-4x measured with benchmarks/memory.py over
# base64 JSON, V2 binary and gRPC, with one image decoding). A JSON number costs more than its few bytes:
# JSON_VALUE_BYTES for each value outside strings (a Python float and its list slot, then numpy's float64 array and
# the signature's dtype: 25-70 bytes a value measured, whatever its digits).
BODY_BYTES_FACTOR = 4
JSON_VALUE_BYTES = 64
# Each tf.Example of a Classify, Regress or MultiInference request, beyond its bytes: the Python bytes object of its
# serialization and its slot in the string vector, twice (serving/core/examples.py); an empty example cost about
# 210 bytes measured (4 million of them in one gRPC Classify: +823 MiB before they were charged).
EXAMPLE_BYTES = 256
