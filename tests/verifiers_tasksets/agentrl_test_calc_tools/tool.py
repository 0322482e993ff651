"""The taskset's tool server: run as ``python -m agentrl_test_calc_tools.tool`` by verifiers."""

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b)


if __name__ == "__main__":
    CalcToolset.run()
