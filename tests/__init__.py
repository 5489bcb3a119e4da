"""The test suite; its folders mirror the rooms of the code."""
