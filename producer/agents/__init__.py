"""What agent runtimes plug in: the outbox's actions as tools (DESIGN.md, "Surfaces": agent-facing).

- ``calls``: one idea of a tool call: its key, made of what the host owns (never the model's free
  text, never per retry), the intent submitted through the same ledger call as every producer, and
  the typed outcome the model is answered with;
- ``catalog``: each action of the actions file as a tool (description, input schema, annotations);
- ``mcp_server``: the MCP server (``agent-outbox mcp``, stdio or streamable HTTP);
- ``openai_agents``: ``outbox_tool(...)`` for the OpenAI Agents SDK (approval = its interruptions);
- ``langgraph``: ``outbox_node(...)`` for LangGraph (approval = ``interrupt()``, resumed by ``Command``).

Each adapter imports its runtime's library only when used (extras ``[mcp]``, ``[openai-agents]``,
``[langgraph]``); the core never imports this package.
"""
