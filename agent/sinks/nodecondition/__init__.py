"""The node's `NPUProblem` condition (`kubectl describe node`): what it says (condition), how it is written (sink)."""
