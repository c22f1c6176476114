"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the
chat-completions path: a request is validated (`protocol`) and translated into a chat request
(`conversation`), served by the chat route's job and stream machinery, and its output read
back as content blocks (`blocks`), a message (`objects`) or Anthropic's events (`stream`);
errors take Anthropic's shape on these routes only (`errors`)."""
