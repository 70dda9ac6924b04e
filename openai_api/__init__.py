"""The OpenAI API surface, shared by the HTTP app (deploy/) and the batch job (cluster/batch/):
request bodies (`protocol`), the OpenAI-named sampling fields and their mapping to
SamplingParams (`params`), tool-call parsers (`tool_parsers`), engine deltas -> OpenAI choices
(`outputs`) and the served model's name (`served_model`). Imports only the engine."""
