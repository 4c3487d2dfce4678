// A window with its sides given directly (the Window / WindowCopy interface of block_info.h), for tests that
// exercise the mask rule and the tile ranges without kernel parameters.
#pragma once

struct TestWindow {
  bool l, r;
  int left_, right_;
  bool has_left() const { return l; }
  bool has_right() const { return r; }
  int left() const { return left_; }
  int right() const { return right_; }
};
