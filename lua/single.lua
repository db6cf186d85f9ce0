-- One check of one rule: KEYS[1] the bucket; ARGV capacity, rate or window
-- (µs), cost. Writes only when the request passes. Replies the decision and
-- the instant (µs) it was decided at, which an undo of its spend names.
local now = now_us()
local allowed, remaining, retry, reset, commit =
  take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), now)
if commit then commit() end
return {allowed, remaining, retry, reset, now}
