"""The python sandbox and the calculator: limits hold, the network is refused, bad input is an answer."""

from __future__ import annotations

import asyncio
import socket

import pytest

from slipstream.agents.config import AgentConfig
from slipstream.agents.expr import ExpressionError, safe_eval
from slipstream.agents.tools import make_tools
from slipstream.agents.tools.sandbox import SandboxLimits, isolation_report, run_python

LIMITS = SandboxLimits(cpu_s=1.0, wall_s=8.0, memory_mb=256, max_output_chars=500)


def run(code, limits=LIMITS):
    return asyncio.run(run_python(code, limits))


def test_runs_code_in_a_private_directory():
    result = run("import os; open('out.txt', 'w').write('hi'); print(sorted(os.listdir('.')), 6 * 7)")
    assert result.status == "ok" and result.output.strip().endswith("42")
    assert "'main.py', 'out.txt'" in result.output


def test_network_is_refused():
    # A listening server on loopback: the kernel would complete a connection even before accept().
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('CONNECTED')\n"
    )
    result = run(code)
    assert result.status == "error"
    assert "CONNECTED" not in result.output
    assert "PermissionError" in result.output or "OSError" in result.output
    with pytest.raises(BlockingIOError):  # nobody connected
        server.accept()
    server.close()
    # Starting a process (e.g. curl) is refused too.
    result = run("import subprocess; subprocess.run(['true'])")
    assert result.status == "error" and "subprocess.Popen is not allowed" in result.output


def test_network_namespace_when_permitted():
    report = asyncio.run(isolation_report())
    if not report["netns"]:
        pytest.skip("this machine does not permit network namespaces; the audit hook is the barrier")
    # The namespace's only interface is its own loopback (down), so even a socket the audit hook missed
    # (native code) could reach nothing.
    result = run("import os; print(open('/proc/net/dev').read())")
    assert result.status == "ok"
    interfaces = [line.split(":")[0].strip() for line in result.output.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"]


def test_files_outside_its_directory_are_read_only_when_permitted(tmp_path):
    if not asyncio.run(isolation_report())["readonly"]:
        pytest.skip("this machine does not permit mount namespaces")
    target = tmp_path / "escape.txt"
    result = run(f"open({str(target)!r}, 'w').write('x')")
    assert result.status == "error" and "Read-only file system" in result.output
    assert not target.exists()


def test_runaway_loop_is_stopped_by_cpu_limit():
    result = run("while True:\n    pass\n")
    assert result.status == "cpu_limit"


def test_sleeping_code_is_stopped_by_wall_time():
    result = run("import time\ntime.sleep(60)\n", SandboxLimits(cpu_s=5, wall_s=1.0))
    assert result.status == "timeout"


def test_memory_and_output_limits():
    assert "MemoryError" in run("x = bytearray(2 << 30)").output
    flood = run("while True:\n    print('x' * 1000)\n")
    assert flood.status == "output_limit" and flood.truncated
    assert len(flood.output) < 700
    long = run("print('y' * 2000)")
    assert long.status == "ok" and long.truncated and "[1501 characters cut]" in long.output


def test_python_tool_reports_limits_as_text():
    tools = make_tools(["python"], AgentConfig(sandbox_cpu_s=1.0, sandbox_wall_s=5.0))
    reply = asyncio.run(tools["python"].call({"code": "while True: pass"}))
    assert reply.startswith("Error: the program used more than 1s of CPU time")


def test_calculator_is_safe():
    calc = make_tools(["calculator"])["calculator"]
    assert asyncio.run(calc.call({"expression": "(3 + 4) * 2 ** 3"})) == "56"
    assert asyncio.run(calc.call({"expression": "sqrt(16) / 8"})) == "0.5"
    assert asyncio.run(calc.call({"expression": "1 / 0"})) == "Error: division by zero"
    assert asyncio.run(calc.call({"expression": "__import__('os').system('true')"})).startswith(
        "Error: unsupported syntax"
    )
    with pytest.raises(ExpressionError, match="exponent"):
        safe_eval("9 ** 9 ** 9")
    with pytest.raises(ExpressionError, match="unsupported syntax: Attribute"):
        safe_eval("(1).__class__")


def test_unknown_tool_name_fails_at_config_time():
    with pytest.raises(ValueError, match="unknown tool `shell`; known tools: python, calculator"):
        make_tools(["shell"])
