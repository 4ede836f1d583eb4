"""Tools: specs checked at bind time (``spec``), how they are written in a prompt and how calls read back
(``format``), and the grammar that constrains a turn's calls or structured reply (``grammar``, llguidance).

    tools = ToolSet([lookup_order, {"type": "function", "function": {...}}])
    session = engine.session([Segment.policy("..."), *engine.tool_segments(tools), Segment.user("Where is A-1042?")])
    gen = session.generate(64, tools=tools, tool_choice="required")
    gen.tool_calls          # (ToolCall(name="lookup_order", arguments={"order_number": "A-1042"}, id="call_..."),)
"""

from kvagent.tools.format import ToolCall, parse_calls, render_calls, result_segment, tool_segments
from kvagent.tools.spec import ToolSet, ToolSpec

__all__ = ["ToolCall", "ToolSet", "ToolSpec", "parse_calls", "render_calls", "result_segment", "tool_segments"]
