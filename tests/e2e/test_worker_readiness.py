"""Several gunicorn workers share the listening sockets: none may take a request before its models are loaded."""
import requests

from server_harness import jpeg, run_server, tiny_model_base


def test_with_two_workers_no_request_lands_on_a_worker_still_loading():
    with run_server(f"--model_base_path={tiny_model_base()}", "--model_name=flowers", "--workers=2", "--port=0",
                    wait_ready=False) as server:
        # As soon as the first worker answers /healthz, every request must be served by a loaded worker.
        answers = [requests.post(server.rest_url + "/v1/models/flowers:classify_image", data=jpeg(),
                                 headers={"Content-Type": "image/jpeg", "Connection": "close"}, timeout=30)
                   for _ in range(24)]
        failed = [a.text for a in answers if a.status_code != 200]
        assert not failed, failed
        assert requests.get(server.rest_url + "/readyz", timeout=10).status_code == 200
