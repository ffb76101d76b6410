"""The embedded default's tiny model."""


def test_building_the_tiny_model_leaves_the_callers_random_state_alone():
    import torch

    from nbddp import demo

    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    demo.build_model()
    assert torch.equal(torch.rand(3), expected)
