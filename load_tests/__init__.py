"""Load testing, shipped with Petal: `petal loadtest` (runner), its Locust users (locustfile), the SLO file and its
parser (slo), and the capacity sweep (sweep). Install with `pip install 'petal[loadtest]'`."""
