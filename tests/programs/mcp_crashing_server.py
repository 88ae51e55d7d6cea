"""A local MCP server whose `crash` tool ends the server process, and whose `pid` tool says which process
it is (the MCP tools test runs it by path, and kills it)."""

import os

try:  # the SDK's high-level server: MCPServer in mcp 2, FastMCP in mcp 1
    from mcp.server import MCPServer
except ImportError:
    from mcp.server.fastmcp import FastMCP as MCPServer

server = MCPServer("crashing")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def crash() -> str:
    """End the server process at once."""
    os._exit(3)


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


if __name__ == "__main__":
    server.run("stdio")
