-- Undoes the spends of an all-or-nothing check on one client's buckets when
-- a rule of another client (another slot) refused the same request.
-- KEYS the buckets; ARGV[1] the instant (µs) at which the multi script spent
-- (the last value of its reply), then four per bucket: algorithm, capacity,
-- rate or window (µs), amount. Each gives back at most what that spend took,
-- to the window the spend counted in, and nothing when that window is gone:
--   token_bucket, gcra: the state, read as a check reads it, moves back by
--     the spend of amount (the whole ns a check of amount moved it), never
--     before now;
--   fixed_window: the spend's window, if the key still holds it, counts
--     amount less, never below 0;
--   sliding_window: the spend's window, still the current or now the
--     previous one of the key, counts amount less, never below 0;
--   sliding_log: up to amount entries logged at the spend's instant go, if
--     that instant is still in the window.
local now = now_us()
local at = tonumber(ARGV[1])

local function undo_instant(key, cap, rate, amount)
  local d = bucket_debt(key, cap, rate, now)
  if d <= 0 then return end
  d = d - spend_ns(amount, rate)
  if d <= 0 then
    redis.call('DEL', key)
  else
    bucket_write(key, now, d)
  end
end

local undos = {
  token_bucket = undo_instant,
  gcra = undo_instant,
  fixed_window = function(key, cap, w, amount)
    local idx = window_index(at, w)
    local count, other = fixed_window_read(key, idx)
    if not other then
      fixed_window_write(key, idx, w, math.max(micro(count - amount), 0), false)
    end
  end,
  sliding_window = function(key, cap, w, amount)
    local v = read_string(key)
    if not v then return end
    local a, cur, prev = string.match(v, '^(%d+) (%S+) (%S+)$')
    a, cur, prev = tonumber(a), micro(tonumber(cur) or 0), micro(tonumber(prev) or 0)
    local spent = window_index(at, w)
    if a == spent then
      cur = math.max(micro(cur - amount), 0)
    elseif a == spent + 1 then
      prev = math.max(micro(prev - amount), 0)
    else
      return
    end
    -- The state stops counting two windows after its own began.
    if (a + 2) * w - now > 0 then
      sliding_window_write(key, a, w, cur, prev, now)
    end
  end,
  sliding_log = function(key, cap, w, amount)
    if at <= now - w then return end
    local score = fmt_int(at)
    local members = redis.pcall('ZRANGEBYSCORE', key, score, score, 'LIMIT', 0, math.floor(amount + 0.5))
    if type(members) == 'table' and not members.err and #members > 0 then
      redis.call('ZREM', key, unpack(members))
    end
  end,
}

for i = 1, #KEYS do
  local j = 1 + (i - 1) * 4
  local undo = undos[ARGV[j + 1]]
  if undo then
    undo(KEYS[i], tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4]))
  end
end
return 1
