"""Adapters that plug offload-core into inference engines. Each imports its engine, so import
the one you need (``offload_core.integrations.vllm``); nothing here is imported by
``import offload_core``."""
