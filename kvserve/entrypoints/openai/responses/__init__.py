"""OpenAI's Responses API (POST /v1/responses) over the chat-completions path: a request is
translated into a chat request (`protocol`, `conversation`), served by the same job and stream
machinery, and its output mapped to Responses objects (`objects`) or events (`stream`);
stored responses (`store`) carry conversations across `previous_response_id`."""
