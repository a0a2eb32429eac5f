"""`urc epp`: the gateway's routing as the endpoint picker of the Gateway API Inference
Extension, an Envoy `ext_proc` server (docs/epp.md)."""
