"""`petal serve` as processes: gunicorn's master (`server`), the flags it starts from, and each worker's life
(`worker`), with what only they use: the ports, the gevent worker, TensorFlow's runtime, the workers' stderr, and
each worker's memory budget. Nothing outside it imports it: it is the top of the server."""
