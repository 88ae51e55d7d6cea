"""A local MCP server of two tools, spoken to over stdio (the MCP tools test runs it by path)."""

try:  # the SDK's high-level server: MCPServer in mcp 2, FastMCP in mcp 1
    from mcp.server import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:
    from mcp.server.fastmcp import FastMCP as MCPServer
    from mcp.server.fastmcp.exceptions import ToolError

server = MCPServer("two-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str, times: int = 1) -> str:
    """Upper-case a text, repeated; refuses empty text."""
    if not text:
        raise ToolError("nothing to shout")  # a failure the server reports to the caller
    return " ".join([text.upper()] * times)


if __name__ == "__main__":
    server.run("stdio")
