"""The TaskD proxy's byte budget: per job and for the node, refused whole, given back exactly."""

from agent.taskd.budget import ByteBudget


def test_limits_per_job_and_per_node():
    budget = ByteBudget(job_limit=100, node_limit=150)
    assert budget.take("a", 60) == ""
    assert budget.take("a", 40) == ""
    assert "job a already holds 100 bytes" in budget.take("a", 1)  # the job is full
    assert budget.take("b", 50) == ""
    assert "node proxy already holds 150 bytes" in budget.take("b", 1)  # the node is full, b is not
    assert (budget.used["a"], budget.used["b"], budget.total) == (100, 50, 150)  # refusals took nothing
    budget.give("a", 60)
    assert budget.take("b", 50) == ""
    budget.give("a", 40)
    budget.give("b", 100)
    assert (dict(budget.used), budget.total) == ({}, 0)


def test_a_message_larger_than_the_limit_is_refused_even_when_empty():
    budget = ByteBudget(job_limit=10, node_limit=10)
    assert budget.take("a", 11)
    assert budget.total == 0
