"""The SGLang side of a request: wire format, async client, routing over servers, in-flight auto-tuning, retry rules."""
