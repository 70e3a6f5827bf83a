"""mm-grpo inside MindSpeed-MM: FLUX registered as a MindSpeed-MM predictor, its entry-script runner,
and the GRPO trainer that runs in MindSpeed-MM's `pretrain` loop. The only package that imports MindSpeed-MM."""
