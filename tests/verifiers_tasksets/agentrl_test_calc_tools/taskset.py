"""The taskset: three multiplications, scored by the answer and by whether the tool was used."""

import verifiers.v1 as vf

from agentrl_test_calc_tools.tool import CalcToolset


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward
    async def exact(self, task: CalcData, trace: vf.Trace) -> float:
        return float(task.answer in (trace.last_reply or ""))

    @vf.reward(weight=0.5)
    async def used_tool(self, task: CalcData, trace: vf.Trace) -> float:
        return float(any(getattr(m, "role", None) == "tool" for m in trace.messages))

    @vf.metric
    async def turns(self, task: CalcData, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> list[CalcTask]:
        pairs = [(6, 7), (3, 5), (12, 4)]
        return [
            CalcTask(
                CalcData(prompt=f"What is {a} * {b}? Use the multiply tool.", answer=str(a * b)),
                self.config.task,
            )
            for a, b in pairs
        ]
