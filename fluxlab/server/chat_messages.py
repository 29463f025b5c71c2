"""The parts of a chat request body: messages (text content parts, an assistant turn's tool calls, a tool
turn's answer) and the function tools a request offers or names. protocol.py's ChatFields holds them."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call an earlier assistant turn made (chat history)."""

    model_config = ConfigDict(extra="ignore")

    id: Optional[StrictStr] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[StrictStr, list[TextPart]]] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant turn's calls
    tool_call_id: Optional[StrictStr] = None  # a tool turn: the call it answers
    name: Optional[StrictStr] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported; only text")
        return value

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict:
        """The message as a chat template takes it (HF's tool_calls convention: arguments as an object)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _json_or_text(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[StrictStr, Field(pattern=FUNCTION_NAME)]
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema of an object (none: any object)")
    strict: Optional[StrictBool] = Field(None, description="ignored: the arguments always follow parameters")


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction
