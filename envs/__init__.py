"""Ready environments, installed as ``agentrl.envs``: ``--env agentrl.envs.NAME:Class`` or a registered id.

The repository keeps them in its top-level ``envs/`` folder; the wheel installs that folder inside
the agentrl namespace (never as a top-level ``envs`` package). ``--env envs.NAME:Class`` still works
(an alias, see :func:`agentrl.registry.load_env`).
"""

from agentrl.registry import register

register("agentrl/Calculator-v0", "agentrl.envs.calculator:Calculator")
register("agentrl/Digits-v0", "agentrl.envs.digits:Digits")
register("agentrl/Countdown-v0", "agentrl.envs.countdown:Countdown")
register("agentrl/Wordle-v0", "agentrl.envs.wordle:Wordle")
register("agentrl/SearchQA-v0", "agentrl.envs.search_qa:SearchQA")
register("agentrl/PythonCode-v0", "agentrl.envs.python_code:PythonCode")
register("agentrl/GSM8K-v0", "agentrl.envs.gsm8k:GSM8K")
register("agentrl/GuessNumber-v0", "agentrl.envs.guess_number:GuessNumber")
register("agentrl/CompactSearchQA-v0", "agentrl.envs.search_qa:CompactSearchQA")
register("agentrl/TicTacToe-v0", "agentrl.envs.tictactoe:TicTacToe")
register("agentrl/TicTacToeVsBot-v0", "agentrl.envs.tictactoe:TicTacToeVsBot")
register("agentrl/HintGuess-v0", "agentrl.envs.hint_guess:HintGuess")
register("agentrl/SWE-v0", "agentrl.envs.swe:SWE")
register("agentrl/Shapes-v0", "agentrl.envs.shapes:Shapes")
