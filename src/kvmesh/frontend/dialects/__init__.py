"""API dialects beside Chat Completions and Completions: OpenAI Responses
(:mod:`.responses`) and Anthropic Messages (:mod:`.messages`), each translated into the
internal chat request and run by the same request owner; their schemas and
translations (``*_api``, pure) and the bounded store of ``previous_response_id``
(:mod:`.store`)."""
