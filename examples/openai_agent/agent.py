"""An ordinary OpenAI-API agent: a calculator tool loop written with the plain `openai` client.

Nothing here knows about agentrl. It reads OPENAI_BASE_URL / OPENAI_API_KEY like any OpenAI program
(agentrl's proxy sets them to the episode's session), takes its task as JSON on stdin (AGENTRL_TASK
holds the same), calls the model until it answers without a tool call, and prints the answer.
"""

from __future__ import annotations

import ast
import json
import operator
import sys

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
                "required": ["expression"],
            },
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The tool: arithmetic only (no eval of model-written code)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"Error: {exc}"
    return str(int(value) if float(value).is_integer() else round(value, 6))


def main() -> None:
    task = json.loads(sys.stdin.read())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    messages = [
        {"role": "system", "content": "Use the calculator tool, then answer with the number only."},
        {"role": "user", "content": task["prompt"]},
    ]
    answer = ""
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments).get("expression", ""))
            except (ValueError, AttributeError) as exc:
                result = f"Error: bad arguments ({exc})"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(answer)


if __name__ == "__main__":
    main()
