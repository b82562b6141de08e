// Model::ForwardSharedPrefix: the learner's forward over a group's rows that computes their
// common prompt once (model.h).
#include <ATen/ATen.h>

#include "common/model/model.h"

namespace grpo::common {

at::Tensor Model::ForwardSharedPrefix(const at::Tensor& prefix_ids, const at::Tensor& prefix_mask,
                                      const at::Tensor& row_prefix, const at::Tensor& suffix_ids,
                                      const at::Tensor& suffix_mask,
                                      bool gradient_checkpointing) const {
  TORCH_CHECK(!deferred_, "the model's weights are not read yet (Model::LoadDeferred)");
  TORCH_CHECK(prefix_ids.dim() == 2 && prefix_ids.size(0) > 0 && prefix_ids.size(1) > 0,
              "ForwardSharedPrefix: prefix_ids must be [U>0, P>0], got ", prefix_ids.sizes());
  TORCH_CHECK(suffix_ids.dim() == 2 && suffix_ids.size(1) > 0,
              "ForwardSharedPrefix: suffix_ids must be [B, C>0], got ", suffix_ids.sizes());
  TORCH_CHECK(prefix_ids.scalar_type() == at::kLong && suffix_ids.scalar_type() == at::kLong,
              "ForwardSharedPrefix: ids must be int64");
  TORCH_CHECK(
      prefix_mask.sizes() == prefix_ids.sizes() && suffix_mask.sizes() == suffix_ids.sizes(),
      "ForwardSharedPrefix: a mask does not match its ids");
  TORCH_CHECK(row_prefix.dim() == 1 && row_prefix.size(0) == suffix_ids.size(0) &&
                  row_prefix.scalar_type() == at::kLong,
              "ForwardSharedPrefix: row_prefix must be [B] int64, got ", row_prefix.sizes());
  TORCH_CHECK(prefix_ids.device() == device() && suffix_ids.device() == device(),
              "ForwardSharedPrefix: ids are not on the model's device ", device());
  const int64_t p = prefix_ids.size(1), c = suffix_ids.size(1);
  const at::Tensor rows = row_prefix.to(device());
  const at::Tensor pmask = prefix_mask.to(device(), at::kLong);
  if (c == 1) {  // only the prefixes' last positions
    return ForwardHidden(prefix_ids, pmask, gradient_checkpointing)
        .select(1, p - 1)
        .index_select(0, rows)
        .unsqueeze(1);
  }
  const auto [ppos, pblocked] = RowPositionsAndBlocked(pmask);  // [U, P], [U, P, P]
  const at::Tensor ppad = pmask == 0;                           // [U, P]
  // The suffixes but their last token (it predicts nothing), after their rows' prefixes:
  // position = the prefix's real tokens + t; keys = the prefix's real columns, then the
  // suffix's real columns up to the query's own.
  const int64_t s = c - 1;
  const at::Tensor sids = suffix_ids.narrow(1, 0, s);
  const at::Tensor smask = suffix_mask.to(device(), at::kLong).narrow(1, 0, s);
  const at::Tensor plen = pmask.sum(1).index_select(0, rows);                  // [B]
  const at::Tensor spos = plen.unsqueeze(1) + at::arange(s, pmask.options());  // [B, S]
  const at::Tensor sblocked =
      at::cat({ppad.index_select(0, rows).unsqueeze(1).expand({-1, s, -1}),
               LaterColumns(s, 0, pmask.options()).unsqueeze(0) | (smask == 0).unsqueeze(1)},
              2);  // [B, S, P + S]
  const auto [pcos, psin] = RopeTables(ppos);
  const auto [scos, ssin] = RopeTables(spos);
  // RunLayer's kSharedInputs; each layer replaces the first two.
  std::vector<at::Tensor> in = {at::Tensor(),
                                at::Tensor(),
                                pcos,
                                psin,
                                AttentionMask(pblocked),
                                scos,
                                ssin,
                                AttentionMask(sblocked),
                                rows};
  // One embedding of both (one [V, D] gradient in its backward, not one per stream).
  const int64_t u = prefix_ids.size(0), b = sids.size(0);
  const at::Tensor embedded = Embed(at::cat({prefix_ids.reshape({-1}), sids.reshape({-1})}));
  in[0] = embedded.narrow(0, 0, u * p).view({u, p, -1});      // [U, P, D]
  in[1] = embedded.narrow(0, u * p, b * s).view({b, s, -1});  // [B, S, D]
  for (size_t li = 0; li < layers_.size(); ++li) {
    const std::vector<at::Tensor> out = LayerStep(li, in, gradient_checkpointing);
    in[0] = out[0];
    in[1] = out[1];
  }
  // The states that predict: each row's prefix's last, then its suffix's; normed together.
  const at::Tensor x =
      at::cat({in[0].select(1, p - 1).index_select(0, rows).unsqueeze(1), in[1]}, 1);  // [B,C,D]
  return NormStep(x, gradient_checkpointing);
}

}  // namespace grpo::common
